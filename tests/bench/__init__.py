"""Tests for tandem.bench (CPU; network traffic only to 127.0.0.1)."""
