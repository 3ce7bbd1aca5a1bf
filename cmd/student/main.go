// Command student makes, trains and exports student models: `init` writes
// a random HF checkpoint of a given architecture and size. Each subcommand
// lives in its own file and registers itself in init.
package main

import (
	"os"

	"distill/compute/device"
	"distill/internal/cli"
)

// commands holds the subcommands; each registers itself from its own file.
var commands = cli.New("student")

func main() {
	device.EnsureCPUCore(os.Stderr)
	commands.Main(os.Args[1:])
}
