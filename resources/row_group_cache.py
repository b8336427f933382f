"""The local disk cache of decoded row groups (diskcache.FanoutCache with a size quota)."""


from typing import Literal

import dagster as dg
from pydantic import Field

from resources.paths import TesseraStorage
from training_core.data import CacheConfig


class RowGroupCache(dg.ConfigurableResource):
    """Local disk cache of decoded row groups shared by cache warming and the training loader."""

    storage: dg.ResourceDependency[TesseraStorage]
    size_limit_bytes: int = Field(2 << 30, gt=0, description="quota for decoded row groups on local disk")
    policy: Literal["evict", "stop_admitting"] = Field(
        "evict", description="at the quota: evict least-recently-stored, or stop admitting (cyclic epochs)"
    )

    def config(self) -> CacheConfig:
        return CacheConfig(self.storage.folder("cache") / "row_groups", self.size_limit_bytes, policy=self.policy)
