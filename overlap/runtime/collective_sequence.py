"""Which collectives need an order word: the sequences of collectives (and step boundaries)
of earlier steps that every rank is known to have run alike, and this step's progress along
them. See [Note: order words only where ranks could part] in overlap/runtime/order_check.py.
"""
from __future__ import annotations

# Sequences kept: a training step, an evaluation forward, a step of several micro-batches...
MAX_KNOWN = 8
# Verifications a known sequence survives without a step that ran it (the first steps', or
# those of a prefetch depth no longer used, would otherwise stay and make parting points).
MAX_AGE = 4
# The element that ends every step's sequence.
CLOSED = -100


class CollectiveSequence:
    """This step's elements (collective fingerprints and boundary codes) against the verified
    sequences of earlier steps. `follows` says whether the step so far is the prefix of a known
    sequence reached without passing a point where known sequences part (where ranks that all
    follow known sequences could follow different ones)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, ...], int] = {}   # sequence -> the verification that last saw it
        self._verifications = 0
        self._unverified: list[tuple[int, ...]] = []   # steps closed since the last verification
        self._step: list[int] = []
        self._matching: list[tuple[int, ...]] = []
        self._unambiguous = True
        self._open_verified = False

    def begin_step(self) -> None:
        # A parting point passed in an earlier step stays passed until a word or a
        # verification: ranks may part at a step's end (one closes it, another goes on).
        self._step = []
        self._matching = list(self._known)
        self._open_verified = False

    def add(self, element: int) -> None:
        """The next element of this step: a collective about to be issued, or a boundary."""
        position = len(self._step)
        following = {seq[position] for seq in self._matching if len(seq) > position}
        if len(following) > 1:
            self._unambiguous = False
        self._matching = [seq for seq in self._matching if len(seq) > position and seq[position] == element]
        if not self._matching:
            # Off every known sequence: for all this rank knows, the others are still on one.
            self._unambiguous = False
        self._step.append(element)

    @property
    def follows(self) -> bool:
        return self._unambiguous and bool(self._matching)

    def agreed(self) -> None:
        """Every rank issued the same collective just now (an order word matched): a point
        where known sequences part is behind every rank alike."""
        self._unambiguous = True

    def end_step(self) -> None:
        self.add(CLOSED)
        if self._open_verified:
            # Verified at its end of backward; nothing but its close came after.
            self._learn(tuple(self._step))
        else:
            self._unverified.append(tuple(self._step))

    def verified(self) -> None:
        """Every rank ran the same elements since the last verification (the end-of-backward
        fingerprints matched): the closed steps since then, and this one so far."""
        self._verifications += 1
        for sequence in self._unverified:
            self._learn(sequence)
        self._unverified = []
        self._open_verified = True
        self._unambiguous = True
        stale = [seq for seq, seen in self._known.items() if seen < self._verifications - MAX_AGE]
        for sequence in stale:
            del self._known[sequence]

    def _learn(self, sequence: tuple[int, ...]) -> None:
        self._known.pop(sequence, None)
        self._known[sequence] = self._verifications
        while len(self._known) > MAX_KNOWN:
            del self._known[next(iter(self._known))]        # the one seen longest ago
