"""The one idea of what a JSON schema is: its subschema keys (``keys``), the one walk over
them (``walk``), the keyword-value checks (``keywords``), the features a backend may lack
(``features``) and the analysis the router decides from (``analysis``).

Every module that reads a schema's structure (the checks, ``normalize``, the router, the
harness) takes it from here, so a keyword added to the table is seen by all of them.
"""
