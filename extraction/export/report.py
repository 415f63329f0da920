"""What an export run did: the ExportReport `export_view` returns and `hsx export-view` prints.

Its own module so that the view (extraction.export.view, which fills it in) and the links
(extraction.export.links, which count into it) both import it, one way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hsx.exitcodes import EXIT_FAILED, EXIT_OK
from hsx.verify import BadShard


@dataclass
class OutputReport:
    output: str
    checked: int = 0
    ok: int = 0
    bad: list[BadShard] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unindexed: int = 0
    index_bad_lines: int = 0


@dataclass
class ExportReport:
    dest: str
    layout: str
    link: str
    level: str
    group_size: int
    outputs: list[OutputReport] = field(default_factory=list)
    added: int = 0  # samples that got a new number this run
    repointed: int = 0  # numbered samples whose source output changed (moved output, bad copy)
    relinked: int = 0  # links made or replaced for samples that already had a number
    unlinked: list[dict[str, Any]] = field(default_factory=list)  # {i, id, reason}
    linked: int = 0  # links in place when the run ended
    numbered: int = 0  # numbers given so far (mapping size)
    not_rechecked: int = 0  # numbered samples whose output was not given this run (left as they were)
    duplicates: list[dict[str, str]] = field(default_factory=list)  # {id, output}: copy not used
    leftovers_removed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # entries in DEST we do not own, left alone
    # {i, id, output, mapping_shard, shard}: mapping lines whose shard path is not the verified
    # index entry's; not followed (the link goes to `shard`), and a correcting line is appended
    mapping_disagreed: list[dict[str, Any]] = field(default_factory=list)
    mapping_torn_tail: bool = False
    seconds: float = 0.0

    @property
    def left_out_bad(self) -> int:
        return sum(len(o.bad) + len(o.missing) for o in self.outputs)

    @property
    def exit_code(self) -> int:
        """0: every eligible shard is linked; 1: some shards were left out as bad or missing."""
        return EXIT_FAILED if self.left_out_bad else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["left_out_bad"] = self.left_out_bad
        d["exit_code"] = self.exit_code
        d["seconds"] = round(self.seconds, 3)
        return d
