"""mmspec"""
