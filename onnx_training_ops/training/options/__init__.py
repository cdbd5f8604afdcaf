"""What a session is opened with: :mod:`.options` (onnxruntime's SessionOptions per program),
:mod:`.providers` (execution providers and the device the state lives on), :mod:`.precision`
(which providers run a 16-bit model, the loss scale's state) and :mod:`.rates` (the learning
rate inputs, their defaults, the schedule).
"""
