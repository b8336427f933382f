import dagster as dg

from assets.partitions import DAILY

# The whole graph for one day: what `tessera demo` and a UI launch materialize.
demo_job = dg.define_asset_job("train_and_promote", selection=dg.AssetSelection.all(), partitions_def=DAILY)
