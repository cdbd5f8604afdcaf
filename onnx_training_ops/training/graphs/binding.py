"""IOBinding: a program's onnxruntime session, bound zero-copy to the state and to preallocated buffers.

onnxruntime reads the state arrays in place (``OrtValue.ortvalue_from_numpy`` + IOBinding), so
state never round-trips through fresh arrays between steps. The outputs that feed state
(update bindings, inputs of cut nodes) and the one-element returned outputs are
preallocated after the first run, when their shapes are known.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

from ...errors import TrainingOpError
from ...passes.dequantize_matmul_nbits import dequantize_matmul_nbits
from ...runtime.contrib_numerics import int8_blocks
from ...runtime.options import select_kernels
from ...runtime.pipeline import prepare_model
from ...runtime.session import InferenceSession
from ...schema import DOMAIN
from ...storage.large_model import LargeModel
from ...storage.tensors import location
from ..arrays import dtype_name, owned
from ..fastpath.in_place import add_finite_guard, in_place_outputs
from ..inputs.feeds import feed_spec
from ..options.providers import CPU, provider_name
from .program import Analysis, Program
from .pruning import prune_unused_initializers


def open_program(
    model: LargeModel,
    analysis: Analysis,
    state: dict[str, np.ndarray],
    sess_options: ort.SessionOptions | None,
    providers: Sequence[str | tuple[str, dict]],
    in_place: bool = False,
    guard: bool = False,
    constants_as_inputs: bool = False,
) -> Program:
    """Create the onnxruntime session and the IOBinding of an analysed program.

    Args:
        model: the graph :func:`~.program.build_program` returned with ``analysis``.
        analysis: what the session does around it.
        state: the state arrays to bind (zero-copy).
        sess_options: the onnxruntime options of this session.
        providers: the execution providers.
        in_place: bind the native optimizers' outputs onto their state arrays where that is
            safe (:mod:`..fastpath.in_place`), so the run updates the state without copies.
        guard: the step may still be undone by the loss check, so the optimizers get a guard
            that stops the run before them on a non-finite loss (without a guard, no in-place
            writes).
        constants_as_inputs: a large model's detached constants become inputs bound to their
            arrays (onnxruntime copies initializers, reads bound inputs in place).

    Returns:
        The open :class:`~.program.Program`.
    """
    combined = model
    constants: dict[str, np.ndarray] = {}
    if constants_as_inputs:  # after prepare's transpose fold
        combined, constants = detached_as_inputs(prepare_model(combined), on_cpu=_on_cpu(providers),
                                                 native=select_kernels(None) == "native")
    graph = combined.model_proto.graph
    rate_inputs = analysis.rate_inputs
    found: dict[str, str] = {}
    guarded = False
    if in_place:
        combined, found, guarded = _in_place(combined, analysis, state, guard)
    prune_unused_initializers(combined.model_proto.graph, rate_inputs)
    session = InferenceSession(combined, sess_options=sess_options, providers=providers)
    del model, combined  # the session holds what it needs
    io = session.io_binding()
    program = Program(analysis, session, io, guarded=guarded)
    # no plugin node left (all optimizers cut): call onnxruntime directly, no kernel-error bookkeeping
    program.uses_plugin = any(n.domain == DOMAIN for n in session.prepared_model.graph.node)
    program.run = session.run_with_iobinding if program.uses_plugin else None
    session_inputs = {i.name for i in session.get_inputs()}
    state_values = _bind_inputs(program, state, constants, session_inputs)
    program.in_place = {out: name for out, name in found.items() if name in state_values}
    for vi in graph.input:
        if vi.name in state or vi.name in rate_inputs or vi.name in constants or vi.name not in session_inputs:
            continue
        spec = feed_spec(vi)
        if vi.name in analysis.input_defaults:  # optional: bound every step, to the default if not fed
            default = owned(numpy_helper.to_array(analysis.input_defaults[vi.name]))
            program.optional_feeds.append((spec, default))
        else:
            program.feeds.append(spec)
    _bind_outputs(program, state_values, in_place)
    program.binding_copies = [
        (state[k], v) for k, v in analysis.binding.items()
        if v not in analysis.cut_outputs and v not in program.in_place
    ]
    program.needs_feeds = any(update.reads_feeds for update in analysis.updates)
    return program


def _on_cpu(providers: Sequence[str | tuple[str, dict]]) -> bool:
    return not providers or provider_name(providers[0]) == CPU


def _in_place(combined: LargeModel, analysis: Analysis, state: dict[str, np.ndarray],
              guard: bool) -> tuple[LargeModel, dict[str, str], bool]:
    """The prepared graph, its optimizer outputs that may be written onto their state
    (:mod:`.in_place`), and whether a finite-loss guard protects them."""
    combined = prepare_model(combined)
    found = in_place_outputs(combined.model_proto.graph, analysis.binding, state)
    if found and guard and analysis.loss_names and \
            not add_finite_guard(combined.model_proto, list(analysis.loss_names)):
        found = {}
    return combined, found, bool(found) and guard and bool(analysis.loss_names)


def _bind_inputs(program: Program, state: dict[str, np.ndarray], constants: dict[str, np.ndarray],
                 session_inputs: set[str]) -> dict[str, ort.OrtValue]:
    """Bind the state, the detached constants and the learning rates (zero-copy, kept alive);
    the state's OrtValues by name."""
    analysis, io = program.analysis, program.io
    state_values = {}
    for name in analysis.state_inputs:
        if name not in session_inputs:
            continue
        value = ort.OrtValue.ortvalue_from_numpy(state[name])
        io.bind_ortvalue_input(name, value)
        program.keep_alive.append(value)
        state_values[name] = value
    for name, array in constants.items():  # bound once, read in place (no copy in onnxruntime)
        if name in session_inputs:
            value = ort.OrtValue.ortvalue_from_numpy(array)
            io.bind_ortvalue_input(name, value)
            program.keep_alive += [array, value]
    for name, buf in analysis.rate_inputs.items():
        if name in session_inputs:
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            io.bind_ortvalue_input(name, value)
            program.keep_alive.append(value)
    return state_values


def _bind_outputs(program: Program, state_values: dict[str, ort.OrtValue], in_place: bool) -> None:
    """Bind the outputs: returned ones to the CPU, fixed ones onto their state (written in place)
    or, for flat cut nodes, onto the kernels' gradient buffers; the dynamic ones last."""
    analysis, io = program.analysis, program.io
    for name in analysis.returned:
        io.bind_output(name, "cpu")
    for name in analysis.fixed_outputs:
        if name in program.in_place:  # the state's own buffer: the kernel writes the new value there
            io.bind_ortvalue_output(name, state_values[program.in_place[name]])
        else:
            io.bind_output(name, "cpu")
    for name in analysis.dynamic_outputs:  # after the fixed ones: their index is known
        io.bind_output(name, "cpu")
    if not in_place:  # the gradients of flat cut nodes go straight into the kernels' G buffers
        for name, view in analysis.cut.gradient_views().items():
            if name in analysis.fixed_outputs:
                value = ort.OrtValue.ortvalue_from_numpy(view)
                io.bind_ortvalue_output(name, value)
                program.keep_alive.append(value)
                program.prebound[name] = view


def detached_as_inputs(model: LargeModel, on_cpu: bool = False, native: bool = False
                       ) -> tuple[LargeModel, dict[str, np.ndarray]]:
    """``model`` whose detached constants are graph inputs, and their arrays. onnxruntime
    copies the initializers it is given (``add_external_initializers`` too: measured), but
    reads a bound input in place: a frozen base model stays one copy (the message is changed
    in place). ``on_cpu``: for the CPU EP, whose ``MatMulNBits`` runs its deployed kernels on
    constant weights only, the nodes reading a weight made an input become its dequantized
    weight and a float GEMM with the deployed numerics (:mod:`...passes.dequantize_matmul_nbits`),
    dequantized by the native kernel where ``native``."""
    graph = model.model_proto.graph
    constants, kept = {}, []
    for tensor in graph.initializer:
        if location(tensor) is None:
            kept.append(tensor)
            continue
        array = model.array(tensor)
        constants[tensor.name] = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if on_cpu:
        dequantize_matmul_nbits(model.model_proto, int8_blocks, native)
    return model.with_proto(model.model_proto), constants


def finish_binding(program: Program, state: dict[str, np.ndarray]) -> None:
    """After the first run: preallocate the fixed outputs and rebind them zero-copy."""
    analysis = program.analysis
    raw = program.io._iobinding
    outputs = raw.get_outputs()
    names = analysis.returned + analysis.fixed_outputs
    values = {name: outputs[i].numpy() for i, name in enumerate(names)}
    flat_grads = analysis.cut.gradient_views(values)
    for name in analysis.fixed_outputs:
        if name in program.in_place:  # bound onto the state array already
            program.fixed_buffers[name] = state[program.in_place[name]]
            continue
        if name in program.prebound:  # onnxruntime wrote it into the kernel's buffer
            program.fixed_buffers[name] = flat_grads.get(name, program.prebound[name])
            continue
        if name in flat_grads:
            buf = flat_grads[name]
            buf[...] = values[name]
        else:
            buf = owned(values[name])
        program.fixed_buffers[name] = buf
        ov = ort.OrtValue.ortvalue_from_numpy(buf)
        program.io.bind_ortvalue_output(name, ov)
        program.keep_alive.append(ov)
    # returned outputs of one element whatever the batch (the loss): preallocated too; others
    # onnxruntime allocates, every run (bound unallocated again: their shape may change)
    program.returned_buffers, program.returned_from_ort = [], []
    declared = {o.name: o.shape for o in program.session.get_outputs()}
    for i, name in enumerate(analysis.returned):
        value = values[name]
        shape = declared.get(name)
        fixed = value.ndim == 0 or (shape is not None and all(isinstance(d, int) for d in shape))
        if value.size == 1 and value.dtype != object and fixed:
            buf = owned(value)
            ov = ort.OrtValue.ortvalue_from_numpy(buf)
            program.io.bind_ortvalue_output(name, ov)
            program.keep_alive.append(ov)
            program.returned_buffers.append((name, buf))
        else:
            program.returned_from_ort.append((name, i))
    copies = []
    for array, name in program.binding_copies:
        buf = program.fixed_buffers[name]
        if buf.dtype != array.dtype or buf.shape != array.shape:
            key = next(k for k, v in state.items() if v is array)
            raise TrainingOpError(
                f"training_info[{program.index}].update_binding: state variable {key!r} is "
                f"{dtype_name(array.dtype)} {list(array.shape)} but {name!r} came out "
                f"{dtype_name(buf.dtype)} {list(buf.shape)}"
            )
        copies.append((array, buf))
    for update in analysis.updates:
        update.prepare(program.fixed_buffers, state)
    program.updates = tuple(update for update in analysis.updates if update.planned)
    program.copy_plan = copies


def release_prebound(program: Program) -> None:
    """Bind the preallocated gradients back to onnxruntime's own buffers (a first run
    refused them: a gradient not shaped like its parameter); the kernels' G buffers are
    made after the run instead."""
    for name in program.prebound:
        program.io.bind_output(name, "cpu")
    program.analysis.cut.drop_gradient_buffers()
    program.prebound = {}
