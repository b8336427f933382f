import dagster as dg

# Daily data partitions; the demo uses the first day so its output never depends on today's date.
DAILY = dg.DailyPartitionsDefinition(start_date="2026-11-01")
DEMO_PARTITION = "2026-11-01"
