package main

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// memAvail is the memory a new allocation of this process can take, and
// what bounds it: the machine's MemAvailable, or the memory limit of the
// process's cgroup (a container's, a Slurm job's), which the machine's
// MemAvailable does not see.
type memAvail struct {
	bytes int64
	// cgroup is the cgroup level whose limit bounds bytes ("": the
	// machine's MemAvailable does): its directory, the limit's file, the
	// limit and the bytes in use under it.
	cgroup       string
	limitFile    string
	limit, inUse int64
	machine      int64 // MemAvailable (-1: not known)
}

// String says what bounds the memory, for an error: "this machine has
// 1.0 GiB available" or "this process may use 1.0 GiB (...)".
func (m memAvail) String() string {
	if m.cgroup == "" {
		return fmt.Sprintf("this machine has %s available", gibString(float64(m.bytes)))
	}
	machine := ""
	if m.machine >= 0 {
		machine = fmt.Sprintf("; the machine has %s available", gibString(float64(m.machine)))
	}
	return fmt.Sprintf("this process may use %s (the memory limit of its cgroup: %s in %s, %s of it in use%s)",
		gibString(float64(m.bytes)), gibString(float64(m.limit)), filepath.Join(m.cgroup, m.limitFile), gibString(float64(m.inUse)), machine)
}

// gibString is b bytes in MiB below a GiB, else in GiB.
func gibString(b float64) string {
	if b < 1<<30 {
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", b/(1<<30))
}

// availableMemory reads the memory this process can take under root ("/"
// on a machine; a test's tree of fake files): the smaller of
// MemAvailable (root/proc/meminfo) and the room under the memory limits
// of the process's cgroup and its ancestors (root/proc/self/cgroup, and
// root/sys/fs/cgroup: cgroup v2's memory.max and memory.current, v1's
// memory.limit_in_bytes and memory.usage_in_bytes; "max", or v1's
// page-counter maximum, is no limit). In use is the usage less the
// inactive file cache (memory.stat), which the kernel reclaims before
// it refuses an allocation. ok is false when neither can be read.
func availableMemory(root string) (m memAvail, ok bool) {
	m = memAvail{bytes: -1, machine: -1}
	if b, err := os.ReadFile(filepath.Join(root, "proc/meminfo")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemAvailable:" {
				if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					m.bytes, m.machine = kb<<10, kb<<10
				}
			}
		}
	}
	for _, l := range cgroupLimits(root) {
		room := max(0, l.limit-l.inUse)
		if m.bytes < 0 || room < m.bytes {
			m.bytes, m.cgroup, m.limitFile, m.limit, m.inUse = room, l.dir, l.file, l.limit, l.inUse
		}
	}
	return m, m.bytes >= 0
}

// cgroupLimit is one cgroup level's memory limit and its use.
type cgroupLimit struct {
	dir, file    string // as the process sees it (/sys/fs/cgroup/...), and the limit's file name
	limit, inUse int64
}

// cgroupLimits lists the memory limits over the process under root: its
// own cgroup's and each ancestor's that sets one (a Slurm job's limit is
// on the job's cgroup, above the step's and the task's).
func cgroupLimits(root string) []cgroupLimit {
	b, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup"))
	if err != nil {
		return nil
	}
	// Lines are ID:CONTROLLERS:PATH; cgroup v2's is 0::PATH. A v1 memory
	// controller (alone, or beside a v2 hierarchy without it) wins.
	var v1, v2 string
	var haveV1, haveV2 bool
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		switch {
		case f[0] == "0" && f[1] == "":
			v2, haveV2 = f[2], true
		case containsField(f[1], "memory"):
			v1, haveV1 = f[2], true
		}
	}
	switch {
	case haveV1:
		return walkCgroup(root, "/sys/fs/cgroup/memory", v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
	case haveV2:
		return walkCgroup(root, "/sys/fs/cgroup", v2, "memory.max", "memory.current", "inactive_file")
	}
	return nil
}

// containsField reports whether the comma-separated list has f.
func containsField(list, f string) bool {
	for _, x := range strings.Split(list, ",") {
		if x == f {
			return true
		}
	}
	return false
}

// walkCgroup reads the limits from the cgroup at mount+cg up to mount.
// Of a path the mount does not hold (a container that sees its own
// cgroup as the mount's root, with the host's path in /proc/self/cgroup)
// the levels it holds are read.
func walkCgroup(root, mount, cg, limitFile, usageFile, inactiveKey string) []cgroupLimit {
	cg = path.Clean("/" + cg)
	for cg != "/" {
		if _, err := os.Stat(filepath.Join(root, mount, cg)); err == nil {
			break
		}
		cg = path.Dir(cg)
	}
	var out []cgroupLimit
	for {
		dir := path.Join(mount, cg)
		if l, ok := readCgroupLimit(filepath.Join(root, dir), limitFile, usageFile, inactiveKey); ok {
			l.dir = dir
			out = append(out, l)
		}
		if cg == "/" {
			return out
		}
		cg = path.Dir(cg)
	}
}

// noLimitV1 is where cgroup v1's "no limit" starts: the page counter's
// maximum in bytes, 9223372036854771712 with 4 KiB pages (more than any
// machine has).
const noLimitV1 = 1 << 62

// readCgroupLimit reads one cgroup level's limit and use; ok is false
// where it sets no limit or its files cannot be read.
func readCgroupLimit(dir, limitFile, usageFile, inactiveKey string) (cgroupLimit, bool) {
	lb, err := os.ReadFile(filepath.Join(dir, limitFile))
	if err != nil {
		return cgroupLimit{}, false
	}
	s := strings.TrimSpace(string(lb))
	if s == "max" {
		return cgroupLimit{}, false
	}
	limit, err := strconv.ParseInt(s, 10, 64)
	if err != nil || limit >= noLimitV1 {
		return cgroupLimit{}, false
	}
	l := cgroupLimit{file: limitFile, limit: limit}
	ub, err := os.ReadFile(filepath.Join(dir, usageFile))
	if err != nil {
		return l, true // a limit whose use is unknown: all of it may be taken
	}
	if l.inUse, err = strconv.ParseInt(strings.TrimSpace(string(ub)), 10, 64); err != nil {
		return cgroupLimit{}, false
	}
	if sb, err := os.ReadFile(filepath.Join(dir, "memory.stat")); err == nil {
		for _, line := range strings.Split(string(sb), "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[0] == inactiveKey {
				if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					l.inUse = max(0, l.inUse-n)
				}
			}
		}
	}
	return l, true
}
