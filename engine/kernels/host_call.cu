// A host call (engine/kernels/host_calls.py): one thread hands job `job` to a host thread through page-locked
// memory the GPU reads and writes over the bus, and waits for its answer. state[0] counts the calls made, state[1]
// names the job of the latest, state[2] counts the calls the host has answered.
extern "C" __global__ void host_call(volatile long long* state, long long job) {
    const long long call = state[0] + 1;
    state[1] = job;
    __threadfence_system();  // the job's name is visible before the call that announces it
    state[0] = call;
    __threadfence_system();
    while (state[2] < call) __nanosleep(256);
    __threadfence_system();  // what the host wrote before answering is visible to the stream's next work
}
