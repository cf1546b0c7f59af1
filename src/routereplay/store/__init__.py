"""RouteStore: every sample's routes kept encoded, merged per engine call, read back by row range.

Files:
- `route_store.py`  `RouteStore`: `add_turn` (checked, merged by token position under a policy),
                    `trace`, `rows`, `encoded`, `save` / `load`; the duplicated-prefix and
                    misaligned-routes refusals
- `sample.py`       one sample: its tokens, metadata and encoded pieces
- `pieces.py`       a sample's routes as encoded pieces, one per engine call, coalesced on read
- `file.py`         the store file: envelope, JSON header, blobs, CRC; every entry checked on read
- `stats.py`        `StoreStats`: samples, rows, bytes
"""

from routereplay.store.route_store import RouteStore
from routereplay.store.sample import DuplicatedPrefixError, MisalignedRoutesError, SampleId
from routereplay.store.stats import StoreStats

__all__ = ["DuplicatedPrefixError", "MisalignedRoutesError", "RouteStore", "SampleId", "StoreStats"]
