"""What a step is fed, checked before onnxruntime runs: :mod:`.feeds` (each program's feeds,
the learning rate), :mod:`.input_checks` (the model's own inputs: shared dimensions, ids within
a table) and :mod:`.checks` (a built loss's labels against its logits, checkpoint properties).
"""
