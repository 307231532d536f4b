// POSIX shared memory transport (see host_shm.h).
#include "host_shm.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace nvc {
namespace host {

static std::runtime_error sys_error(const std::string& what, const std::string& name) {
  return std::runtime_error("jax_nvcomm: " + what + " '" + name + "': " + std::strerror(errno));
}

static void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int saved = errno;
  close(fd);
  errno = saved;
  if (p == MAP_FAILED) throw sys_error("mmap of shared memory", name);
  return p;
}

void* shm_create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw sys_error("shm_open(create)", name);
  if (ftruncate(fd, off_t(bytes)) != 0) {
    int saved = errno;
    close(fd);
    ::shm_unlink(name.c_str());
    errno = saved;
    throw sys_error("ftruncate of shared memory", name);
  }
  return map_fd(fd, bytes, name);
}

void* shm_map(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw sys_error("shm_open", name);
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < bytes) {
    close(fd);
    throw std::runtime_error("jax_nvcomm: shared memory '" + name + "' is smaller than expected");
  }
  return map_fd(fd, bytes, name);
}

void shm_unlink(const std::string& name) { ::shm_unlink(name.c_str()); }
void shm_unmap(void* p, size_t bytes) {
  if (p != nullptr) munmap(p, bytes);
}

}  // namespace host
}  // namespace nvc
