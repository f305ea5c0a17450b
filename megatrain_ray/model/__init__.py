"""Model description: the flat layout of stages and the stateless layer templates."""
