"""LMDB storage with persist-before-acknowledge group commit."""
