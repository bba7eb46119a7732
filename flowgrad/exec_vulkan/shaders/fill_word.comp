// Replaces the bits of one 32-bit word that `keep` does not cover:
// words[index] = (words[index] & keep) | (value & ~keep). Recorder.fill uses it
// for the half-word ends of an f16 view, which vkCmdFillBuffer cannot write.
#version 450
layout(local_size_x = 1) in;
layout(binding = 0) buffer Words { uint words[]; };
layout(push_constant) uniform Push { uint index; uint keep; uint value; } p;

void main() {
    words[p.index] = (words[p.index] & p.keep) | (p.value & ~p.keep);
}
