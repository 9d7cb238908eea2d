"""Static builds that one artifact's ``main`` dispatches to: a dynamic model's shape buckets
(``buckets.py``, on an input's exact size) and the branches of an If on an input's value
(``branches.py``, on the If's condition); ``renaming.py`` keeps their kernels apart."""
