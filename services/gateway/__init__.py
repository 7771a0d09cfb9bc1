"""The gateway: OpenAI-compatible HTTP API in front of the mesh (DESIGN.md sections 2 and 6)."""
