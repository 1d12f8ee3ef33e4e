"""The contract between the layers: placements and specs (``spec``), the plan (``plan``), its
pipeline stages (``pipeline``), its memory decisions (``memory``), the option values that the API,
the CLI and the solver share (``options``), and the plan's JSON schema. Deciding produces these;
doing reads them. Nothing here imports any other part of autopar but ``autopar.errors``."""
