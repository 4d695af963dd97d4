"""Commands that work on what training made, beside training itself (export, plan)."""
