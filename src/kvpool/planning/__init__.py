"""Memory planning: how many pages, tokens and sequences fit a budget or a device
(`planner.plan_memory`), and how a budget splits between a model's layer groups
(`group_plan`).

May import: memory and kvpool's shared modules; the planner reads a model's geometry from
`kvpool.models.config` (its config parser), and nothing else of models."""
