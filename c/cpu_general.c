/* c/cpu_general.c: CPU kernels for the problems c/cpu_kernels.c does not serve: per-level point
 * counts, nearest sampling, fused softmax (msda_needs_general()). Not yet written. */
#include "msda_internal.h"

int msda_cpu_forward_general(const msda_problem *pr) {
    (void)pr;
    return msda_set_error(MSDA_ERR_UNSUPPORTED,
                          "msda_forward: level_points, MSDA_NEAREST and MSDA_SOFTMAX are not "
                          "implemented on the CPU yet");
}

int msda_cpu_backward_general(const msda_problem *pr) {
    (void)pr;
    return msda_set_error(MSDA_ERR_UNSUPPORTED,
                          "msda_backward: level_points, MSDA_NEAREST and MSDA_SOFTMAX are not "
                          "implemented on the CPU yet");
}
