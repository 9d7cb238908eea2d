"""Auto-scheduling per target: MetaSchedule tuning of our fused kernels into stored tuning logs.

``commands.tune.tune_model`` tunes; ``load_records`` + ``ApplyTuningRecords`` apply what the logs
hold at compile time (apply.py); ``logs`` (show, merge, prune, diff) manages them.
"""
