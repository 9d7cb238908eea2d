"""An example tvm_fusion plugin: one fusion pattern (``pattern.py``) and its schedule rule
(``schedule.py``), registered by the entry points in ``pyproject.toml``."""
