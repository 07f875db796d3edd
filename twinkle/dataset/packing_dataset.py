"""`PackingDataset`: encoded rows packed into rows of at most ``template.max_length`` tokens;
upstream's ``twinkle.dataset.packing_dataset``."""

from __future__ import annotations

from typing import Any

from twinkle.dataset._rows import Row
from twinkle.dataset._sources import DatasetMeta
from twinkle.dataset.base import Dataset
from twinkle.infra import remote_class, remote_function
from twinkle_fn.data import pack_greedy


@remote_class(execute="first")
class PackingDataset(Dataset):
    """Encoded rows packed into rows of at most ``template.max_length`` tokens (2048 if None).

    After `encode`, `pack_dataset` groups the rows (first-fit decreasing,
    `twinkle_fn.data.pack_greedy`); row ``i`` is then group ``i`` concatenated as upstream:
    token-level lists (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``) are
    joined, positions restarting at 0 for each sample, other fields become lists. The
    `InputProcessor` splits such a row at the restarts and packs it padding-free.
    ``packing_num_proc`` is accepted (packing runs in this process).
    """

    def __init__(
        self, dataset_meta: DatasetMeta | None = None, packing_num_proc: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(dataset_meta, **kwargs)
        self.packing_num_proc = packing_num_proc
        self.packed_idx: list[list[int]] | None = None

    @remote_function(execute="first")
    def pack_dataset(self) -> None:
        """Group the encoded rows into packs.

        Raises ``ValueError`` when no template is set or the rows are not encoded, and
        `pack_greedy`'s error for a row longer than the pack size.
        """
        template = self._require_template()
        if not self.rows or "input_ids" not in self.rows[0]:
            raise ValueError("pack_dataset needs encoded rows; call encode() first")
        self.packed_idx = pack_greedy(self.rows, template.max_length or 2048)

    def _packs(self) -> list[list[int]]:
        if self.packed_idx is None:
            raise RuntimeError("call pack_dataset() before reading a PackingDataset")
        return self.packed_idx

    def __len__(self) -> int:
        return len(self._packs())

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        rows = [self.rows[i] for i in self._packs()[index]]
        out: Row = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if isinstance(values[0], list) and values[0] and isinstance(values[0][0], int | float):
                out[key] = [v for value in values for v in value]
            else:
                out[key] = values
        return out
