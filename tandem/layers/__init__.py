"""Model building blocks: attention, linear, norm, rotary, activation, sampler."""
