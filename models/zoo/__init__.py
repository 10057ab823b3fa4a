"""The bundled reference zoo: small trained weights (safetensors) and their reports."""
