"""The generation engine: sequences, blocks, scheduling, model running, the offline API."""
