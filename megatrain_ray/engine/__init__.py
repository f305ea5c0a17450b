"""The layer stream: device streams and events, and the engine that runs one training step."""
