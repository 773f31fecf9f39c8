"""Memory planning: how many pages, tokens and sequences fit a budget or a device
(`planner.plan_memory`), and how a budget splits between a model's layer groups
(`group_plan`). The planner takes a model's geometry (`geometry.ModelGeometry`, which a
model config provides) and imports no model code.

May import: memory and kvpool's shared modules; not models, the engine or the CLI."""
