"""The public front end: :class:`~.session.TrainingSession`, a thin class over the engine
(:mod:`..engine`), with :mod:`.from_graph` (``TrainingSession.from_graph``: a plain graph that
holds its optimizer), :mod:`.session_summary` (``repr`` and ``to_torch_state_dict``) and
:mod:`.locked` (one call at a time per session).
"""
