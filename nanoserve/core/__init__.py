"""The core: a whole engine on its own, the portable path (docs/architecture.md, in order)."""
