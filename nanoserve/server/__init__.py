"""The OpenAI-compatible HTTP front: routes, protocol, serving logic, metrics, errors."""
