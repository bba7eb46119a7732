// Shared by the optimizer shaders (sgd, sgd_momentum, adam, sumsq): each
// invocation walks the elements with a grid stride, so a launch of at most
// flowgrad.training.optim.MAX_GROUPS groups of 256 covers any param size.
#define STRIDE (gl_NumWorkGroups.x * 256u)
