"""LoRA adapters on one base model: PEFT checkpoints read and checked, slot-indexed
adapter weights, and every targeted linear computing the step's adapters in one batched
shrink and expand. Runs in the engine core's process."""
