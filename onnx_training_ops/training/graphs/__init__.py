"""The graphs onnxruntime runs and one step of them: :mod:`.program` (a TrainingInfoProto's
algorithm as a program, its frozen analysis), :mod:`.stages` (cut at the Gradient node:
evaluate, backward, apply), :mod:`.pruning`, :mod:`.inference` (the main graph for ``run`` and
``export_inference_model``), :mod:`.static_shapes` (data shapes fixed and folded),
:mod:`.binding` (the zero-copy IOBinding) and :mod:`.step` (feed, run, check, write the state).
"""
