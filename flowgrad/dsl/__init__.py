"""The `.flow` language: Lark grammar (flowgrad/grammars/flow.lark) -> parse
tree -> Graph (a Lark Transformer), with source spans on every node.

    parse(text, file) -> Program      syntax only; raises FlowError
    build(program, config, dtype)     -> Graph; config overrides are validated,
                                      declared f32 tensors become `dtype`
"""
