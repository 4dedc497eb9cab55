#include "cc/testing/check.h"

PERSEUS_TEST_MAIN()
