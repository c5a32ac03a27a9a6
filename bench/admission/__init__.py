"""`tandem bench admission`: the router's priorities and fair shares under overload (`main`)."""
