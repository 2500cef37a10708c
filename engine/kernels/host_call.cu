// A host call (engine/kernels/host_calls.py): one thread hands job `job` to a host thread through page-locked
// memory the GPU reads and writes over the bus, and waits for its answer. state[0] counts the calls made, state[1]
// names the job of the latest, state[2] counts the calls the host has answered. A stream has one call out at a
// time: host_call posts and waits; host_call_post and host_call_wait split the two, so that the GPU works between
// them while the host runs the job.
__device__ __forceinline__ void post(volatile long long* state, long long job) {
    const long long call = state[0] + 1;
    state[1] = job;
    __threadfence_system();  // the job's name is visible before the call that announces it
    state[0] = call;
    __threadfence_system();
}

__device__ __forceinline__ void wait_answer(volatile long long* state) {
    const long long call = state[0];
    while (state[2] < call) __nanosleep(256);
    __threadfence_system();  // what the host wrote before answering is visible to the stream's next work
}

extern "C" __global__ void host_call(volatile long long* state, long long job) {
    post(state, job);
    wait_answer(state);
}

extern "C" __global__ void host_call_post(volatile long long* state, long long job) { post(state, job); }

extern "C" __global__ void host_call_wait(volatile long long* state) { wait_answer(state); }

// out[i] (+)= answer[i] (+ extra[i]): a host job's result read from page-locked memory, added to what the GPU
// computed (add; extra, where not null, a second part of it) or taking its place.
extern "C" __global__ void add_host_answer(float* __restrict__ out, const volatile float* answer,
                                           const float* __restrict__ extra, int n, int add) {
    grid_dependency_sync();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = (add ? out[i] : 0.0f) + (extra != nullptr ? extra[i] : 0.0f) + answer[i];
}
