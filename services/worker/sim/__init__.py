"""worker/sim"""
