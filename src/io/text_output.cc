#include "hspmd/io/text_output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "hspmd/core/error.h"
#include "hspmd/io/output_file.h"

namespace hspmd {

void write_output_file(const std::string& what, const std::string& path, const std::string& text) {
  check_output_file(what, path, OutputWrite::kStream);
  // O_NONBLOCK: opening a FIFO that has no reader fails (ENXIO) instead of
  // waiting for one; the fstat below refuses a FIFO that has one.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0666);
  if (fd < 0) {
    if (errno == ENXIO) fail(what, " ", path, ": is a FIFO, not a file or device; refusing to block on it");
    fail(what, " ", path, ": cannot open for writing: ", std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)) {
    ::close(fd);
    fail(what, " ", path, ": is a FIFO or socket, not a file or device; refusing to block on it");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail(what, " ", path, ": write failed (disk full or I/O error): ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) fail(what, " ", path, ": write failed (disk full or I/O error): ", std::strerror(errno));
}

}  // namespace hspmd
