"""The optimizers, one module each: reference math, scalars, element, description, lowering.

:mod:`.adam` (Adam, AdamW), :mod:`.momentum` (torch's SGD), :mod:`.adagrad`, :mod:`.rmsprop`,
:mod:`.ort_adamw` (onnxruntime-training's AdamW); :mod:`.registry` lists them all, and
:class:`.base.Optimizer` is the contract of a description. The kernels
(:mod:`onnx_training_ops.kernels`) compile the elements into their loops; the builder reads
the descriptions; ``passes.lower_optimizers`` calls the lowerings.
"""
