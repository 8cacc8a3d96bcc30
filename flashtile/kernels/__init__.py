"""The kernels and their launch plans, by backend: portable/ (Triton, any GPU and the CPU
interpreter) and hopper/ (Gluon, sm90). plans.py is shared: a launch worked out once per call
signature and replayed. Nothing here knows about autograd or modules: launchers take tensors
(inputs and preallocated outputs), a ScoreParams and a PackedSeqs (flashtile/options.py), and
launch; flashtile/dispatch.py decides which of them serves a call."""
