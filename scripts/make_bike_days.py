"""Write flowgrad/models/data/bike_days.csv, the tabular example's data.

    python scripts/make_bike_days.py          # (re)writes the file
    python scripts/make_bike_days.py --check  # exit status 1 if the file differs from what this script makes

240 made-up days of a bike-hire station: the temperature (a tenth of the
cells left empty, as a broken sensor leaves them), humidity, wind, whether
it was a holiday, the weather as a word, and the demand (low, medium, high:
the thirds of a score the other columns make, plus noise). Drawn from a
fixed seed, so the file is the same on every run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "flowgrad" / "models" / "data" / "bike_days.csv"
DAYS = 240
WEATHER = {"clear": 1.0, "cloudy": 0.3, "rain": -1.2, "snow": -2.0}   # each one's part of the score
CHILL = {"clear": 0.0, "cloudy": -2.0, "rain": -3.0, "snow": -12.0}   # snow comes on cold days


def rows(seed: int = 2024) -> str:
    rng = np.random.default_rng(seed)
    weather = rng.choice(list(WEATHER), DAYS, p=[0.4, 0.3, 0.2, 0.1])
    temp = rng.normal(16, 6, DAYS) + [CHILL[w] for w in weather]
    humidity = np.clip(rng.normal(60, 15, DAYS) + 20 * (weather == "rain"), 15, 100)
    wind = rng.gamma(2.0, 7.0, DAYS)
    holiday = rng.random(DAYS) < 0.1
    score = (0.15 * temp - 0.03 * humidity - 0.05 * wind - 0.8 * holiday + [WEATHER[w] for w in weather]
             + rng.normal(0, 0.4, DAYS))
    low, high = np.quantile(score, [1 / 3, 2 / 3])
    demand = np.where(score < low, "low", np.where(score < high, "medium", "high"))
    missing = rng.random(DAYS) < 0.1
    lines = ["temp,humidity,wind,holiday,weather,demand"]
    for i in range(DAYS):
        lines.append(f"{'' if missing[i] else f'{temp[i]:.1f}'},{humidity[i]:.0f},{wind[i]:.0f},{int(holiday[i])},"
                     f"{weather[i]},{demand[i]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = rows()
    if argv == ["--check"]:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT}: {'as this script makes it' if same else 'differs from what this script makes'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT} ({DAYS} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
