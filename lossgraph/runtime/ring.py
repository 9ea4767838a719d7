"""Weights and optimizer states in arrays rotated between steps, never copied: the state ring.

A training graph reads the state (weights, optimizer states) as inputs and writes
the next state as outputs. :class:`StateRing` keeps a ring of one, two or three sets of
arrays; a :class:`GraphRunner` holds one ``SessionIOBinding`` per set (inputs from that
set, outputs into the next one), so a step only rebinds its data batch. With one set, a
step writes the next state over the one it reads: its graphs must be built for it
(:mod:`lossgraph.passes.in_place`), and the state is held once. After a
successful step the next set becomes the live one (:meth:`StateRing.advance`); after a
failed one it does not, and the state is still the one before the step. A third set, where
the ring has one, keeps the state before the last successful step: a
loss is computed at a step's input state, so when a step's loss is not finite, its input
state is the one that diverged, and the one before it (:meth:`StateRing.step_back`) is the
last whose loss was finite. Two sets hold the state twice, three sets thrice: on a large
model each set costs as much memory as its weights and optimizer states.

Groups of state tensors of one dtype can be *packed*: laid end to end in one flat array
per set, each tensor a view of its part. A graph then reads or writes the whole group
as one vector (a runner binds the group by its tuple of names), with no copy: the
separate mode's update of every weight at once (:mod:`lossgraph.runtime.separate_step`).

Every OrtValue here aliases a numpy array that this module keeps alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import InternalError
from ..initial_state import InitialState
from .session import cpu_device, evaluation_error, ortvalue

__all__ = ["Block", "StateRing", "GraphRunner"]


#: A packed group of state tensors: their names, in the order they are laid end to end.
Block = tuple[str, ...]


class StateRing:
    """A ring of buffer sets for the named state tensors; ``current`` holds the live state,
    a step writes the next one into set :meth:`following`.

    Each group in ``packed`` (names of one dtype) lies end to end in one flat array per
    set (``blocks[group][set]``, also bindable as an OrtValue), its tensors views of it.
    ``sets``: 3 keeps the state before the last step (:meth:`step_back`), 2 does not, 1
    has each step write over the live state (graphs that write in place only).
    """

    def __init__(self, names: Sequence[str], initial: InitialState,
                 packed: Sequence[Sequence[str]] = (), sets: int = 3) -> None:
        if sets not in (1, 2, 3):
            raise InternalError(f"A state ring has 1, 2 or 3 buffer sets, not {sets!r}.")
        #: how many buffer sets: the live state, the next one a step writes (but with one
        #: set) and with three the one before the last step
        self.sets = sets
        self.names = list(names)
        self.device = cpu_device()
        self._index = {name: i for i, name in enumerate(self.names)}
        self.blocks: dict[Block, list[np.ndarray]] = {}
        self.arrays = [self._allocate(initial, packed) for _ in range(self.sets)]
        self.values = [[ortvalue(a, self.device) for a in arrays] for arrays in self.arrays]
        self._block_values = {block: [ortvalue(flat, self.device) for flat in flats]
                              for block, flats in self.blocks.items()}
        self.current = 0
        self.load(initial)

    def _allocate(self, initial: InitialState,
                  packed: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """One set of arrays shaped like ``initial``'s (not read); each packed group views
        one flat array."""
        arrays: dict[str, np.ndarray] = {}
        for group in packed:
            parts = [initial.like(n) for n in group]
            flat = np.empty(sum(p.size for p in parts), parts[0].dtype)
            ends = np.cumsum([p.size for p in parts])
            for name, part, end in zip(group, parts, ends):
                arrays[name] = flat[end - part.size:end].reshape(part.shape)
            self.blocks.setdefault(tuple(group), []).append(flat)
        return [arrays[n] if n in arrays else np.empty_like(initial.like(n), order="C")
                for n in self.names]

    def value(self, parity: int, state: str | Block):
        """The OrtValue of state tensor ``state`` (or of a packed group, by its tuple of
        names) in buffer set ``parity``."""
        if isinstance(state, tuple):
            return self._block_values[state][parity]
        return self.values[parity][self._index[state]]

    def following(self, parity: int) -> int:
        """The set a step reading set ``parity`` writes the next state into."""
        return (parity + 1) % self.sets

    def live(self) -> dict[str, np.ndarray]:
        """The live state, by name (the arrays themselves: copy what must outlive a step)."""
        return dict(zip(self.names, self.arrays[self.current]))

    def advance(self) -> None:
        """Make the last step's outputs the live state; the state it read is kept, for
        :meth:`step_back`."""
        self.current = self.following(self.current)
        self._kept = True

    @property
    def keeps_previous(self) -> bool:
        """Whether a third set keeps the state before the last step (:meth:`step_back`)."""
        return self.sets == 3

    def step_back(self) -> bool:
        """Make the state before the last :meth:`advance` live again, where it is kept
        (once: the set before it has been written since); False when it is not."""
        if not (self._kept and self.keeps_previous):
            return False
        self.current = (self.current - 1) % self.sets
        self._kept = False
        return True

    @contextmanager
    def chaining(self, names: Sequence[str]) -> Iterator[Callable[[], None]]:
        """State tensors ``names`` (buffers: running statistics) updated by every run of a
        group while the rest waits for its last run (the micro-batches of one update).

        Each run writes their next values into the following set; the function yielded
        copies them into the live set, for the next run to read. On leaving, the live set
        holds the values it held on entering (the group's last run wrote its own into the
        following set), so a group that fails changes nothing the caller sees.
        """
        if self.sets == 1 and names:
            raise InternalError("A ring of one buffer set cannot hold a group's buffers "
                                "apart from the live ones.")
        live = self.live()
        following = dict(zip(self.names, self.arrays[self.following(self.current)]))
        saved = [live[name].copy() for name in names]

        def carry() -> None:
            for name in names:
                live[name][...] = following[name]

        try:
            yield carry
        finally:
            for name, array in zip(names, saved):
                live[name][...] = array

    def load(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy ``state`` into the live arrays (no earlier state is kept then)."""
        for name, array in zip(self.names, self.arrays[self.current]):
            array[...] = state[name]
        self._kept = False


class GraphRunner:
    """Runs one training graph over the state ring with pre-built bindings.

    ``state_inputs`` maps graph inputs to state names (or packed groups), ``state_outputs``
    graph outputs to state names (or packed groups); ``fixed`` binds small owned arrays
    (learning rate, step, loss) whose contents the caller updates in place between runs.
    """

    def __init__(self, session, ring: StateRing,
                 state_inputs: Mapping[str, str | Block],
                 state_outputs: Mapping[str, str | Block],
                 fixed_inputs: Mapping[str, np.ndarray] | None = None,
                 fixed_outputs: Mapping[str, np.ndarray] | None = None,
                 graph: str = "training") -> None:
        from onnxruntime.capi import _pybind_state as C

        self.graph = graph
        self._session = session._sess
        self._run_options = C.RunOptions()
        self.ring = ring
        fixed_inputs, fixed_outputs = fixed_inputs or {}, fixed_outputs or {}
        self._keep = [*fixed_inputs.values(), *fixed_outputs.values()]
        fixed = {n: ortvalue(a, ring.device) for n, a in fixed_inputs.items()}
        outputs = {n: ortvalue(a, ring.device) for n, a in fixed_outputs.items()}
        self._keep += [*fixed.values(), *outputs.values()]
        self._outputs: dict[str, tuple[np.ndarray, object]] = {}
        self._data: list[tuple] = [()] * ring.sets  # per binding: the arrays it aliases
        self._bindings = []
        for parity in range(ring.sets):
            binding = C.SessionIOBinding(self._session)
            for name, state in state_inputs.items():
                binding.bind_ortvalue_input(name, ring.value(parity, state))
            for name, state in state_outputs.items():
                binding.bind_ortvalue_output(name, ring.value(ring.following(parity),
                                                                 state))
            for name, value in fixed.items():
                binding.bind_ortvalue_input(name, value)
            session.bind_frozen(binding)
            for name, value in outputs.items():
                binding.bind_ortvalue_output(name, value)
            self._bindings.append(binding)

    def bind_output(self, name: str, array: np.ndarray) -> None:
        """Write output ``name`` into ``array`` from now on (kept alive here until rebound)."""
        value = ortvalue(array, self.ring.device)
        self._outputs[name] = (array, value)
        for binding in self._bindings:
            binding.bind_ortvalue_output(name, value)

    def run(self, data: Mapping[str, Any]) -> None:
        """One run on the live state; ``data`` holds OrtValues or C-contiguous arrays (they
        are aliased).

        The arrays stay referenced until this binding's next run rebinds them, since the
        binding still holds OrtValues over their memory.
        """
        parity = self.ring.current
        binding = self._bindings[parity]
        if data:
            values = [ortvalue(value, self.ring.device) if isinstance(value, np.ndarray)
                      else value for value in data.values()]
            for name, value in zip(data, values):
                binding.bind_ortvalue_input(name, value)
            self._data[parity] = (data, values)
        try:
            self._session.run_with_iobinding(binding, self._run_options)
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise evaluation_error(self.graph, exc) from None
