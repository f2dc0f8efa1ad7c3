"""The reliability campaign: long fault-injection tests, outside the default suite."""
