"""The 32 demo-model prompts the LLM and gRPC-worker tests share (16 chat questions, 16 texts)."""

QUESTIONS = [
    "What is the capital of France?", "Name a prime number.", "How do bees make honey?",
    "What is 2 + 2?", "Why is the sky blue?", "Give me a synonym for happy.",
    "Who wrote Hamlet?", "What is the boiling point of water?", "Translate 'cat' to French.",
    "What is the largest planet?", "How many legs does a spider have?", "Define gravity.",
    "What color is a banana?", "What is a haiku?", "Name an ocean.", "What is rust?",
]
TEXTS = [
    "The history of the printing press", "def add(a, b):", "Once upon a time",
    "The three primary colors are", "In 1969, astronauts", "A recipe for pancakes:",
    "The quick brown fox", "Photosynthesis is the process", "import numpy as np\n",
    "My favourite season is", "The mitochondria is", "Dear team,\n",
    "Water boils at", "The tallest mountain on Earth", "Rain falls when", "Chess is a game",
]
