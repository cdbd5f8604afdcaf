"""Updates written into the state in place instead of by onnxruntime's graph:
:mod:`.in_place_updates` (the interface) with :mod:`.fast_path` (optimizer nodes run by the fused
kernels), :mod:`.rmsprop_fast_path`, :mod:`.row_updates` (lazy table rows) and
:mod:`.gated_updates` (loss-scaled steps); :mod:`.in_place` (``fast=False``: the native kernels
write the state arrays); :mod:`.sources` (where each input of such an update comes from).
"""
