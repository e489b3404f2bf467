"""Small helpers the lessons and tools share: atomic results files, showing source."""
