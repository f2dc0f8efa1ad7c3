"""Transports: one protocol handler, with HTTP, WebSocket and in-process adapters."""
