"""placeholder while bootstrapping"""
