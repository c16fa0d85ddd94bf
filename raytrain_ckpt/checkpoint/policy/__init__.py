"""Pure decisions, each a function of plain facts tested with a table: retention, the save interval
(``auto``), the save schedule and ``on_busy``, which step ``latest``/``best``/``N`` means. Imports only
``format``."""
