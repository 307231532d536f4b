// Host transport: POSIX shared memory segments, one per rank, mapped by every rank of the group
// (threads of one process or processes of one machine). A new segment is zero-filled, so its
// Ctrl block starts at seq 0 with no flag raised.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace nvc {
namespace host {
void* shm_create(const std::string& name, size_t bytes);  // throws std::runtime_error
void* shm_map(const std::string& name, size_t bytes);     // throws std::runtime_error
void shm_unlink(const std::string& name);
void shm_unmap(void* p, size_t bytes);
}  // namespace host
}  // namespace nvc
