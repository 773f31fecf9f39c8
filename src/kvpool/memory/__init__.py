"""Device memory: the layout of a page (`layout`, fp8 formats in `fp8`), the allocator of page
ids (`allocator`, with `first_fit`), the pool of K/V pages allocated once (`pool`, and
`grouped_pool` for models whose layer groups have pools of their own), the Mamba state slots
(`state_pool`) and the step's scratch memory (`workspace`).

May import: torch and kvpool's shared modules (errors, numeric, devices, threads, formats).
Nothing here knows about sequences, models or the engine."""
